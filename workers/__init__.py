"""Process supervision: the one launcher that owns its workers (signals forwarded, no orphans) and local ranks."""
