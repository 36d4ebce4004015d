"""CPU paths: paged attention in plain torch and prepacked (blocked) linear layers."""
