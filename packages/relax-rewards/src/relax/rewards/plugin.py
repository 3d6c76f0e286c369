"""Entry point of relax-rewards: registers the hub's rewards with relax-core."""
