"""What runs beside the maths: diagnostics a forward reports to (Amax gain, connection
health), selective recomputation, and durable file writes shared by every part.
"""
