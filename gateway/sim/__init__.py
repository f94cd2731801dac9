"""`prefixgate sim`: the fleet simulator — the real engine, admission and routing on a virtual clock."""
