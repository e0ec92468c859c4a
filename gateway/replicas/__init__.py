"""Gateway replicas sharing their load through Redis."""
