"""What runs beside the maths: diagnostics a forward reports to (Amax gain, connection
health), selective recomputation, durable file writes shared by every part, and the count
of optimizer steps the ops' no-autograd caches compare.
"""
