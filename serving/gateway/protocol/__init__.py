"""The OpenAI API as the gateway serves it: the routes it allows, its error shapes, the shape of
stream events, and the upstream's errors turned into the gateway's own. Pure: no I/O."""
