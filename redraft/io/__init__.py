"""Prompt, model and file helpers shared by every front end: prompt text -> ids (:mod:`redraft.io.prompts`),
loading target models (:mod:`redraft.io.loading`), the bundled Spec-Bench questions (:mod:`redraft.io.questions`),
prompt files and ``[TOKENS]`` logs -> corpus spans (:mod:`redraft.io.freeze`) and atomic writes
(:mod:`redraft.io.atomic`)."""
