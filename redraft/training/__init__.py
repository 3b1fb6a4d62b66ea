"""Training and evaluating GliDe draft models: the back ends of ``redraft glide train|eval``.

These modules run the target model (training data, self-distillation) and the engine (evaluation), so they sit
above :mod:`redraft.glide` (the draft network and its checkpoints) and the drafters, never below them.
"""
