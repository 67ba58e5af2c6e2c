"""The progressive alpha controller (``[lora.alpha_schedule]``, docs/alpha_schedule.md): the observer, its device-side
statistics and the replay what-if table."""
