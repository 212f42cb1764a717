"""Using a trained model: `export` a checkpoint as a Hugging Face directory, `generate` from it in batch,
`chat` with it."""
