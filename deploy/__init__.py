"""Deployment helpers: the load generator (``deploy/loadtest.py``) and its library."""
