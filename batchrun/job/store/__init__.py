"""The output store: layout, parts and commit markers, claims, locks, fingerprint, restart, verify, metrics."""
