"""What :func:`changestream.consume` and :func:`changestream.aio.consume` decide, by concern.

Both consume loops (``changestream/aio/_consume.py`` and its generated sync twin) only do the
I/O between these decisions, so a fix lands once:

- :mod:`.run`: one run (:class:`~.run.Run`): what each poll, handled change and failure
  leads to, and the result;
- :mod:`.saves`: the save schedule (:class:`~.saves.SaveSchedule`): which token is safe to
  store and when;
- :mod:`.retry`: which failures are transient, the backoff between reopens
  (:class:`~.retry.RetryPolicy`);
- :mod:`.dead_ends`: what no retry can fix, and the error that says how to recover;
- :mod:`.handler_errors`: a handler that keeps failing (:class:`~.handler_errors.OnError`);
- :mod:`.history`: a lost history (``on_history_lost``, :class:`~.history.HistoryGap`);
- :mod:`.options`: one run's options, checked once (:class:`~.options.ConsumeOptions`);
- :mod:`.bounds`: what bounds a run from outside (each call's timeout, stop signals).
"""
