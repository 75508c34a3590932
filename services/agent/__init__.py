"""The node agent: one process per training host, draining the hook rings onto the bus."""
