"""The browser UI (Gradio), mounted in the server process."""
