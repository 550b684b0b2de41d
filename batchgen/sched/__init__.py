"""The scheduler: decides with token and page counts only, never touches tensors."""
