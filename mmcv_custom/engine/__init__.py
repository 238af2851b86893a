"""MMEngine glue: thin adapters between the runner and the hook math."""
from .comm_hook_registration_hook import CommHookRegistrationHook

__all__ = ['CommHookRegistrationHook']
