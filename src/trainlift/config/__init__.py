"""Typed specs (pydantic v2) for jobs and clusters, loaded from YAML."""
