"""mmad: a cross-API MMA dispatch runtime that trains and serves small MLPs."""

__version__ = "0.1.0"
