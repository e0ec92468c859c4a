"""The backends: their state, health checks, vLLM metrics scraping, aiohttp's errors mapped once, the κ_crit feed,
keeping the index true."""
