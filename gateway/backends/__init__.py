"""The backends: health checks, vLLM metrics scraping, the κ_crit feed, keeping the index true."""
