"""Pure-Python engine core (no torch): scheduler, KV block manager. Arrives with the engine issue."""
