"""One file per model family: its config reading, its checkpoint names and its layers' wiring
(``minfer.model.registry`` maps HF ``architectures`` names to the classes here)."""
