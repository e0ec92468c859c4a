"""The upstream seam: the aiohttp session, one attempt's request and its headers, and the one
mapping of aiohttp's exceptions to gateway errors (used by the proxy and the health checks)."""
