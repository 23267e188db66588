"""A training run's lifecycle, the same for every backend: config, loop, checkpoints, logs, outputs.

::

    RunConfig (run_config)      how a run trains, beside the plan that says what it trains
    train_loop (loop)           steps of the stage executor, LR and loss scale (schedules)
    checkpoints, run_folder     what survives a crash, one run per folder
    runlog, tensorboard,        what the run leaves behind
    run_outputs, sampler
"""
