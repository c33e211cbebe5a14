"""Health and metrics: the top of the apps. It reads every app below it (the engine's
status, admission, the registry, leases, steering documents) and nothing imports it but
the site's URLs."""
