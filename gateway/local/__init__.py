"""Serving on the local engine: fan-out of one HTTP request into engine requests, the prefix registry and its pins, the engine log line; imports http and tenancy."""
