# Turns the plugin on: inherit this and set `comm_hook` in your config, e.g.
#   _base_ = ['../_base_/comm_hook.py']
#   comm_hook = dict(type='bf16_compress')
custom_imports = dict(imports=['mmcv_custom'], allow_failed_imports=False)
custom_hooks = [dict(type='CommHookRegistrationHook')]
