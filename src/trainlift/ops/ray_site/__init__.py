"""The sitecustomize of the Ray processes trainlift starts (see sitecustomize.py)."""
