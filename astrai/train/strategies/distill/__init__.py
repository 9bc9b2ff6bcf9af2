"""On-policy and offline distillation: the student learns the teacher's token distributions."""
