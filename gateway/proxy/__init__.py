"""Proxy mode: upstream pool, routing policies, relay with verification, usage accounting, proxy prefixes and their routes; imports http, tenancy, api."""
