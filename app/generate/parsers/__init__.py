"""A model's generated text read back into fields: reasoning (`<think>`), tool calls in each family's wire format,
the format a tokenizer declares; streamed and whole."""
