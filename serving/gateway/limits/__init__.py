"""Rate limits, daily token budgets and monthly dollar budgets: one limiter interface with a Redis
implementation (shared by every replica, scripts in .lua files beside it) and a local one (used
while Redis is unreachable); the usage ledger; the tenants' limits and counters in Redis."""
