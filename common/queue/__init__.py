"""The Celery app and Redis: delivery settings, hand-offs, keys, and the reconciler's healing."""
