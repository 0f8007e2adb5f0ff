"""The unified-memory policy. Pure arithmetic plus one ledger."""
