"""The fair queue in front of each model: tiers and per-tenant fair shares (fair_share, pure;
fair_queue.lua the same in Redis) and the live replica counts that size it (replica_feed)."""
