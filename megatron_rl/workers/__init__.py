"""Megatron-side roles: Actor (trains the policy), Critic (trains the value model) and
ReferencePolicy (forward-only), sharing one schedule runner; each is built from a `RoleModel`
(`workers/spec.py`), the model it runs."""
