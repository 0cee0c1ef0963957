"""What failures and weight updates cost: goodput under updates and server deaths, tokens lost per killed worker."""
