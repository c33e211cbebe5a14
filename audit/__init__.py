"""The audit log: who changed what, when, and how it ended (docs/security.md, "Audit log").

The layer just above ``core``: registry, steering, orchestration and the apps above them
record their changes of state through ``audit.services``; it imports nothing but core."""
