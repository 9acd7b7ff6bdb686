"""Operations: device leases, the heartbeat, the container healthcheck."""
