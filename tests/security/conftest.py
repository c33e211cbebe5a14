"""The attacker's suite (docs/security.md): each file sends one kind of attack to a live
server and checks that nothing happened, not only the status."""
