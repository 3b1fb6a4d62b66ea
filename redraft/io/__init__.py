"""Prompt, model and file helpers shared by every front end: prompt text -> ids (:mod:`redraft.io.prompts`),
loading target models (:mod:`redraft.io.loading`), the bundled Spec-Bench questions (:mod:`redraft.io.questions`),
prompt files and ``[TOKENS]`` logs -> corpus spans (:mod:`redraft.io.freeze`), atomic writes
(:mod:`redraft.io.atomic`) and progress bars that draw only on a terminal (:mod:`redraft.io.progress`)."""
