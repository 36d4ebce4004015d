"""CPU paths of the layers: prepacked (blocked) linear layers. (The CPU attention backend is
`llmfast/attention/cpu.py`.)"""
