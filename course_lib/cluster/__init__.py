"""The modeled cluster: hardware profiles, the modeled clock, topologies, collective algorithms and the link-level
simulation that checks them, placement, and this device measured."""
