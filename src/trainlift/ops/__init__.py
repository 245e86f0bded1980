"""Side effects: subprocesses and, later, lifecycle and job operations."""
