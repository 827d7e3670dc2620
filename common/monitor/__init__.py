"""The run monitor's shared state in Redis: counts, pauses, resumes, its rebuild from storage."""
