"""Controller: places roles on Ray and drives the RL loop in the configured mode."""
