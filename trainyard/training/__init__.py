"""Stage 4, training: the torchft trainer each replica group runs, and the supervisor around them."""

from trainyard.training.plan import TrainingPlan
from trainyard.training.supervisor import TrainingOutcome, load_model, preflight, train

__all__ = ["TrainingOutcome", "TrainingPlan", "load_model", "preflight", "train"]
