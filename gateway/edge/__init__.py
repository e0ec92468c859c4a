"""The edge's HTTP hygiene: errors as OpenAI answers, keys, admission, bodies, request ids, the access log."""
