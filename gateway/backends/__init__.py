"""The backends: their state, health checks, vLLM metrics scraping, the κ_crit feed, keeping the index true."""
