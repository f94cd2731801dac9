"""HTTP plumbing shared by both modes: connections, middlewares, errors, SSE, request ids, access log, metrics, server; imports no other room."""
