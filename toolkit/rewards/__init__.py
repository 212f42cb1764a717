"""Rule-based reward functions shipped with the toolkit (name them in `reward.functions`)."""
