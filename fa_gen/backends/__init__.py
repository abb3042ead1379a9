"""Backends turn rendered source into a loaded, callable kernel for one arch."""
