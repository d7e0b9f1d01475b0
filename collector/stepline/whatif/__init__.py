"""`stepline whatif`: what each scheduler lever would buy on the recorded workload, from a replay of it through the
simulator's scheduler with the engine's own step cost fitted from its recorded steps."""
