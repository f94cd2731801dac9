"""Who may call and how much: API keys, per-key limits and salts, admission, state shared by replicas (in-process or Redis); imports http only."""
