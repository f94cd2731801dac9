"""The HTTP load generator (``prefixgate bench serve``, ``prefixgate bench compare``) and the SDK's
own benchmark; an API client that imports only the SDK (servers are started as processes).
"""
